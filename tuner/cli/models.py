"""`tuner models`: the model families, hf model types and installed plugins a recipe can name."""

from __future__ import annotations

import json

import typer


def models_cmd(
    as_json: bool = typer.Option(False, "--json", help="The same listing as GET /v1/models, as JSON."),
) -> None:
    """List model families, the hf family's model types, and installed plugins with their options.

    \b
    Examples:
      tuner models
      tuner models --json
    """
    from tuner.models.catalog import models_catalog

    cat = models_catalog()
    if as_json:
        typer.echo(json.dumps(cat, indent=2))
        return
    typer.echo("Families (model.family):")
    for f in cat["families"]:
        own = f"  fields: {', '.join(f['fields'])}" if f["fields"] else ""
        typer.echo(f"  {f['name']:<7} {f['description']}{own}")
        if f.get("model_types"):
            typer.echo(f"          model_type: {', '.join(f['model_types'])}")
    typer.echo("Plugins (model.family: plugin, model.plugin):")
    if not cat["plugins"]:
        typer.echo("  none installed (an entry point in the group tuner.models adds one)")
    for p in cat["plugins"]:
        if "error" in p:
            typer.echo(f"  {p['name']}: cannot load: {p['error']}")
            continue
        typer.echo(f"  {p['name']}: {p['description']}")
        for key, prop in p["options"].get("properties", {}).items():
            default = f" (default {prop['default']})" if "default" in prop else ""
            typer.echo(f"    options.{key}: {prop.get('type', '')} {prop.get('description', '')}{default}")


def register(app: typer.Typer) -> None:
    app.command("models")(models_cmd)
