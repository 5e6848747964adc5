"""slime's command line in the job spec: every slime flag's status (flags.py, megatron_flags.py), the argv converter
(args.py), and the spec parts only slime's flags need (config.py, eval_config.py)."""
