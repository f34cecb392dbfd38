"""Code that runs inside a trial process. Never imports FastAPI, SQLAlchemy, Optuna or Ray."""
