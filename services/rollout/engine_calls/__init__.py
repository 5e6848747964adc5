"""A sample's requests to the engines through the router: slime's generate contract and the request context
(generate.py) over pooled HTTP posters (router_http.py). Below both the generation loop and the agent gateway, which
each call it; it knows nothing of prompts, groups or sessions."""
