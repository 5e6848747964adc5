"""A rank for test_launch: local rank 1 fails at once with exit code 3, local rank 0 would wait forever."""

import os
import sys
import time

if __name__ == "__main__":
    if os.environ["LOCAL_RANK"] == "1":
        sys.exit(3)
    while True:
        time.sleep(1)
