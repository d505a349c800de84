from lmforge.cli import main

raise SystemExit(main())
