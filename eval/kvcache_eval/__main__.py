import sys

from .evaluate import main

sys.exit(main())
