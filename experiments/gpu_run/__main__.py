import sys

from experiments.gpu_run.runner import main

sys.exit(main())
