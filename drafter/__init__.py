"""hetero-specdecode drafter: proposes tokens locally, has them verified remotely."""
