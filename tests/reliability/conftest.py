"""The pipeline tests' tiny projects, for the reliability scenarios that run stages."""

from tests.flows.conftest import built_project, tiny_project  # noqa: F401  (fixtures)
