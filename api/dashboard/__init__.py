"""The web dashboard of jobs and trials: HTML pages under /ui and their aggregate endpoints under
/ui/api, served by the API's own app (see `routes.router`)."""

from api.dashboard.routes import router

__all__ = ["router"]
