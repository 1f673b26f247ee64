import sys

from flashtree.cli.main import main

sys.exit(main())
