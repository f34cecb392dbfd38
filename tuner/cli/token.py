"""`tuner token create|list|revoke`: API tokens for the REST service (stored as sha256 hashes)."""

from __future__ import annotations

import typer

from tuner.cli.common import fail

token_app = typer.Typer(
    help=(
        "API tokens for the REST service's writes (and reads), stored as sha256 hashes.\n\n"
        "\b\nExamples:\n  tuner token create --name ci-bot\n  tuner token list\n  tuner token revoke ci-bot"
    ),
    no_args_is_help=True,
)


def _session():
    from tuner.db import session_scope

    return session_scope()


def _no_database_yet() -> bool:
    """A listing or a revoke finds nothing in a database not made yet, and looking must not make it."""
    from tuner.settings import database_url
    from tuner.storage import not_made_yet

    return not_made_yet(database_url())


def _ready() -> None:
    from sqlalchemy import exc

    from tuner.db import DatabaseError
    from tuner.migrations import is_current, upgrade

    try:
        if not is_current():
            upgrade()
    except DatabaseError as err:
        fail(str(err))
    except exc.DBAPIError as err:  # unreachable server, unopenable SQLite file, refused login
        fail(f"cannot open the database: {err.orig}; check TUNER_DATABASE_URL")


@token_app.command("create")
def create_cmd(
    name: str = typer.Option(..., "--name", help="Who or what uses the token, e.g. ci-bot."),
) -> None:
    """Create a token and print it once; only its hash is stored.

    \b
    Examples:
      tuner token create --name ci-bot
      export TUNER_API_TOKEN=$(tuner token create --name nightly)
    """
    from api.auth import TokenError, create_token

    _ready()
    try:
        with _session() as session:
            token = create_token(session, name)
    except TokenError as err:
        fail(str(err))
    typer.echo(token)
    typer.echo(
        f"token {name!r} created; it is shown only now. Send it as 'Authorization: Bearer <token>'.", err=True
    )


@token_app.command("list")
def list_cmd() -> None:
    """Token names, when they were created, and whether they are revoked.

    \b
    Example:
      tuner token list
    """
    from api.auth import list_tokens

    if _no_database_yet():
        typer.echo("no tokens; create one with `tuner token create --name NAME`")
        return
    _ready()
    with _session() as session:
        rows = [(t.name, t.created_at, t.revoked_at) for t in list_tokens(session)]
    if not rows:
        typer.echo("no tokens; create one with `tuner token create --name NAME`")
    for name, created, revoked in rows:
        status = f"revoked {revoked:%Y-%m-%d %H:%M}" if revoked else "active"
        typer.echo(f"{name:<30} created {created:%Y-%m-%d %H:%M} UTC  {status}")


@token_app.command("revoke")
def revoke_cmd(name: str = typer.Argument(..., help="The token's name (see `tuner token list`).")) -> None:
    """Revoke a token by name; requests with it get 403 from then on.

    \b
    Example:
      tuner token revoke ci-bot
    """
    from api.auth import TokenError, revoke_token

    if _no_database_yet():
        fail(f"no token named {name!r}: there is no database yet (see TUNER_DATABASE_URL)")
    _ready()
    try:
        with _session() as session:
            revoke_token(session, name)
    except TokenError as err:
        fail(str(err))
    typer.echo(f"token {name!r} revoked")


def register(app: typer.Typer) -> None:
    app.add_typer(token_app, name="token")
