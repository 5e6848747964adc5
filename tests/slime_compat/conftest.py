"""The integration modules' shared router, for the adapter test that runs an agent on a real stack."""

from tests.integration.conftest import session_router, shared_router  # noqa: F401 - fixtures
