"""kvplane as an inference endpoint picker (EPP) behind a gateway.

The Gateway API Inference Extension's endpoint-picker protocol (its proposal 004) is
Envoy's external-processing gRPC service: the gateway streams each request's headers
and body to the picker, which answers with the chosen pod as ``ip:port`` in the
``x-gateway-destination-endpoint`` header and in the ``envoy.lb`` dynamic metadata,
then follows the response through its phases. The choice is the router's own
(``RoutingPipeline`` and ``PDService``); this package only speaks the protocol.
"""
