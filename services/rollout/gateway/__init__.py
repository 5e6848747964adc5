"""The agent gateway: OpenAI Chat Completions and Anthropic Messages over the engines' /generate, one session per
sample, recording the exact tokens the engines produced.

It lives in the rollout service, not in a service of its own, because a session *is* one sample of a group the
manager is generating: the manager opens it, runs the agent, and drains it into the sample in memory, and the
gateway's turns go through the manager's own router client (its deadlines, retries, request slots, abort of a full
batch and weight-version record). A service of its own would need a proto to open, drain and abort sessions and a
copy of every trajectory on the wire, for no isolation the rollout service does not already give.
"""
