"""``serve --account``'s API side: the API process's parts wrapped (``account.py`` names
them) and the ``/account`` routes."""

from specdec.engine import text_stream
from specdec.entrypoints import api_server
from specdec.entrypoints.account import Account


def count_api(account: Account, engine) -> None:
    """Wrap the API process's parts (a ProcessEngine's submit and pipe reader, tokenizing,
    detokenizing, JSON) in ``account``; call before ``engine.start()``."""
    engine.submit = account.timed(engine.submit, "submit")
    engine._on_readable = account.timed(engine._on_readable, "receive")
    for name in ("encode", "encode_chat"):
        setattr(api_server, name, account.timed_async(getattr(api_server, name), "tokenize"))
    text_stream.TextStream.add = account.timed(text_stream.TextStream.add, "detokenize")

    class TimedJson:  # api_server's json: dumps timed, the rest as it was
        dumps = staticmethod(account.timed(api_server.json.dumps, "serialize"))
        loads = staticmethod(api_server.json.loads)
        JSONDecodeError = api_server.json.JSONDecodeError

    api_server.json = TimedJson


def serve_account(app, engine) -> None:
    """``serve --account``: count this process's parts and add ``GET /account`` and
    ``POST /account/reset`` to the app (before it starts)."""
    account = Account()
    count_api(account, engine)

    @app.get("/account")
    async def report():
        return {"api": account.report(), "engine": await engine.account()}

    @app.post("/account/reset")
    async def reset():
        account.reset()
        await engine.account(reset=True)
        return {}
