"""Pure renderers: kvplane specs in, Kubernetes manifests (plain dicts) out.

No I/O and no clients here, so the controller stays thin and every manifest the
operator can produce is checked by golden files and by vLLM's own argument parser
(tests/test_render.py, tests/test_render_vllm_args.py).
"""

from kvplane.operator.render.engine import engine_deployment, pd_transfer
from kvplane.operator.render.engines import EnginePod, adapter
from kvplane.operator.render.engines.sglang import sglang_args, sglang_env
from kvplane.operator.render.engines.vllm import vllm_args, vllm_env
from kvplane.operator.render.lmcache import lmcache_config
from kvplane.operator.render.names import Role, generation_tag
from kvplane.operator.render.pool import inference_pool_objects
from kvplane.operator.render.router import indexer_objects, router_config, router_objects
from kvplane.operator.render.stores import index_url, mooncake_objects, redis_objects
from kvplane.operator.render.tiers import RenderError

__all__ = [
    "EnginePod",
    "RenderError",
    "Role",
    "adapter",
    "engine_deployment",
    "generation_tag",
    "index_url",
    "indexer_objects",
    "inference_pool_objects",
    "lmcache_config",
    "mooncake_objects",
    "pd_transfer",
    "redis_objects",
    "router_config",
    "router_objects",
    "sglang_args",
    "sglang_env",
    "vllm_args",
    "vllm_env",
]
