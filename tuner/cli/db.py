"""`tuner db upgrade`: bring the service's tables up to date (the API also does this at startup)."""

from __future__ import annotations

from typing import NoReturn

import typer

from tuner.cli.common import fail

db_app = typer.Typer(
    help=(
        "The service database (TUNER_DATABASE_URL, default sqlite:///tuner.db).\n\n"
        "\b\nExamples:\n  tuner db upgrade\n  tuner db current --database-url postgresql+psycopg://tuner@db/tuner"
    ),
    no_args_is_help=True,
)


def _url_or_exit(ctx: typer.Context, database_url: str | None) -> tuple[str, str]:
    """The database URL (a relative SQLite file made absolute, as everywhere else) and the name to
    blame in an error: --database-url when the user typed it, else TUNER_DATABASE_URL. A URL
    SQLAlchemy cannot parse, or whose driver is not installed, exits 2 here."""
    from sqlalchemy import exc

    from tuner.db import DatabaseError, get_engine
    from tuner.settings import absolute_database_url
    from tuner.settings import database_url as default_url

    source = ctx.get_parameter_source("database_url")
    name = "--database-url" if source is not None and source.name == "COMMANDLINE" else "TUNER_DATABASE_URL"
    url = absolute_database_url(database_url) if database_url else default_url()
    try:
        get_engine(url)  # parses the URL and loads its driver; connects to nothing yet
    except (DatabaseError, exc.ArgumentError) as err:
        _fail_naming(err, name)
    return url, name


def _fail_naming(err: Exception, name: str) -> NoReturn:
    # tuner.db's messages name the environment variable; name the option if that is what was used.
    message = str(err).replace("TUNER_DATABASE_URL", name)
    fail(message if name in message else f"{name}: {message}")


@db_app.command("upgrade")
def upgrade_cmd(
    ctx: typer.Context,
    database_url: str = typer.Option(
        None, "--database-url", envvar="TUNER_DATABASE_URL", help="Database URL."
    ),
) -> None:
    """Create or migrate the service's tables (jobs, builds, tokens, nightly results) and Optuna's.

    \b
    Examples:
      tuner db upgrade
      TUNER_DATABASE_URL=postgresql+psycopg://tuner@db:5432/tuner tuner db upgrade
    """
    from sqlalchemy import exc

    from tuner.db import DatabaseError
    from tuner.migrations import prepare_database
    from tuner.storage import refuse_another_programs

    url, name = _url_or_exit(ctx, database_url)
    try:
        refuse_another_programs(url, name, f"another {name}")  # as every command: never into another's
    except ValueError as err:
        fail(str(err))
    try:
        before, after = prepare_database(url)  # Optuna's tables too: one database, one command
    except DatabaseError as err:
        _fail_naming(err, name)
    except exc.DBAPIError as err:  # e.g. permission denied: not the OperationalError upgrade handles
        fail(f"cannot migrate the database: {err.orig}; check {name}")
    typer.echo(
        f"database schema: {before or 'empty'} -> {after}"
        if before != after
        else f"database schema: {after} (current)"
    )


@db_app.command("current")
def current_cmd(
    ctx: typer.Context,
    database_url: str = typer.Option(
        None, "--database-url", envvar="TUNER_DATABASE_URL", help="Database URL."
    ),
) -> None:
    """Show the schema revision and whether it is current.

    \b
    Examples:
      tuner db current
      tuner db current --database-url sqlite:////srv/tuner/tuner.db
    """
    from sqlalchemy import exc

    from tuner.db import DatabaseError
    from tuner.migrations import current_revision, head_revision
    from tuner.storage import not_made_yet, sqlite_path

    url, name = _url_or_exit(ctx, database_url)
    if not_made_yet(url):  # a look makes no file
        typer.echo(
            f"empty (behind {head_revision()}; no database at {sqlite_path(url)} yet: `tuner db upgrade` creates it)"
        )
        return
    try:
        rev = current_revision(url)
    except DatabaseError as err:
        _fail_naming(err, name)
    except exc.DBAPIError as err:  # unreachable server, unopenable SQLite file, refused login
        fail(f"cannot read the database: {err.orig}; check {name}")
    head = head_revision()
    typer.echo(f"{rev or 'empty'} ({'current' if rev == head else f'behind {head}; run `tuner db upgrade`'})")


def register(app: typer.Typer) -> None:
    app.add_typer(db_app, name="db")
