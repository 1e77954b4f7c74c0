"""The HTTP edge: the app, its routes, the fast path of POST /verify, API keys, the state the app
holds."""
