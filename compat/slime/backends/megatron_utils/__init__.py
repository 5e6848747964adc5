"""slime.backends.megatron_utils: only cp_utils, which slime's MIS helper imports."""
