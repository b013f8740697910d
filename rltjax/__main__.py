import sys

from rltjax.entrypoints.cli import main

sys.exit(main())
