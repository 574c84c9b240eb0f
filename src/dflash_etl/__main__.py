from dflash_etl.cli import main

raise SystemExit(main())
