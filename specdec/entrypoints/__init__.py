"""``specdec serve``: an OpenAI-compatible HTTP server around one ``LLM``.

Needs the ``serve`` extra (fastapi, uvicorn, prometheus-client); nothing else in specdec imports
this package, so the library and the other commands work without it.
"""
