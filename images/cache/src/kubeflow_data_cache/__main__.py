from kubeflow_data_cache.cli import main

raise SystemExit(main())
