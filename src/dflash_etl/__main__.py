from dflash_etl.cli.main import main

raise SystemExit(main())
