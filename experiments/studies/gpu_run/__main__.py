import sys

from experiments.studies.gpu_run.runner import main

sys.exit(main())
