import sys

from kvplane.bench.overhead.run import main

sys.exit(main())
