from tokenflow.replicas.launch import main

raise SystemExit(main())
