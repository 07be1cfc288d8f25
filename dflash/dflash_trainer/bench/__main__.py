from .step import main

raise SystemExit(main())
