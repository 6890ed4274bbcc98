"""The benchmarks: one module per `headrace bench NAME`, each with `main(argv)`, `--quick` and
`--json` (they ship in the package, so an installed headrace runs them anywhere)."""
