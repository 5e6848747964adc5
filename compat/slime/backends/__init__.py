"""slime.backends: only what slime's TIS helpers import (megatron_utils.cp_utils)."""
