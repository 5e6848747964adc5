"""The generation loop: lease prompts from the buffer, fan each out to its samples through the router, score them,
filter and write groups (manager.py drives it; groups.py, scoring.py, partial.py, drain.py the parts; each request
goes through engine_calls/). It sees engines only through the router, and the pool only through a weight-version
callable."""
