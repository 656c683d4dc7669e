import sys

from gpuwatch.apps.cli import main

sys.exit(main())
