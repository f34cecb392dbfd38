"""`tuner db upgrade`: bring the service's tables up to date (the API also does this at startup)."""

from __future__ import annotations

import typer

from tuner.cli.common import fail

db_app = typer.Typer(
    help=(
        "The service database (TUNER_DATABASE_URL, default sqlite:///tuner.db).\n\n"
        "\b\nExamples:\n  tuner db upgrade\n  tuner db current --database-url postgresql+psycopg://tuner@db/tuner"
    ),
    no_args_is_help=True,
)


@db_app.command("upgrade")
def upgrade_cmd(
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
    from tuner.db import DatabaseError
    from tuner.migrations import prepare_database
    from tuner.settings import absolute_database_url
    from tuner.settings import database_url as default_url

    url = absolute_database_url(database_url) if database_url else default_url()
    try:
        before, after = prepare_database(url)  # Optuna's tables too: one database, one command
    except DatabaseError as err:
        fail(str(err))
    typer.echo(
        f"database schema: {before or 'empty'} -> {after}"
        if before != after
        else f"database schema: {after} (current)"
    )


@db_app.command("current")
def current_cmd(
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

    from tuner.migrations import current_revision, head_revision

    try:
        rev = current_revision(database_url)
    except exc.OperationalError as err:
        fail(f"cannot read the database: {err.orig}; check TUNER_DATABASE_URL")
    head = head_revision()
    typer.echo(f"{rev or 'empty'} ({'current' if rev == head else f'behind {head}; run `tuner db upgrade`'})")


def register(app: typer.Typer) -> None:
    app.add_typer(db_app, name="db")
