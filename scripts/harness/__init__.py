"""What scripts/ and tests/ share and the shipped packages do not: local verifiers and
`serve` processes on loopback, replicas behind a private nginx, a delaying proxy, a
/metrics reader. Scripts put the repository root on sys.path to import it."""
