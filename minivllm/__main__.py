import sys

from minivllm.cli import main

sys.exit(main())
