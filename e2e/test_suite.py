"""The shared suites (tests and their fixtures), collected against the external cluster."""

from test_crds_apiserver import (  # noqa: F401
    crds,
    test_invalid_objects_are_rejected_with_a_clear_message,
    test_valid_objects_get_server_side_defaults,
)
from test_operator import (  # noqa: F401
    operator,
    test_aggregated_pool_comes_up_and_reports_status,
    test_missing_references_are_reported_as_degraded,
    test_prefill_decode_pool_is_disaggregated,
)
