from videodit.cli import main

raise SystemExit(main())
