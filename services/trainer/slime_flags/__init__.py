"""slime's command line in the job spec: every slime flag's status (flags.py, megatron_flags.py), slime's argv read as
its argparse reads it (argv.py), the argv as spec keys (args.py), and slime's --eval-config (eval_config.py)."""
