"""The KV connector API: config validation, factory by name and module path, aggregation."""

import json
import sys
import types

import pytest

from enginecore.kv_transfer import (
    KVConnectorBase_V1,
    KVConnectorFactory,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    KVOutputAggregator,
    KVTransferConfig,
)


class _RecordingConnector(KVConnectorBase_V1):
    def start_load_kv(self, forward_context, **kwargs):
        self.loaded = self._get_connector_metadata()

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 16, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()


def test_config_from_cli_json_and_validation():
    cfg = KVTransferConfig.from_cli('{"kv_connector": "X", "kv_role": "kv_both", '
                                    '"kv_connector_extra_config": {"a": 1}}')
    assert cfg.is_kv_producer and cfg.is_kv_consumer and cfg.kv_load_failure_policy == "recompute"
    assert cfg.get_from_extra_config("a", 0) == 1 and cfg.engine_id
    with pytest.raises(ValueError, match="kv_role"):
        KVTransferConfig.from_cli({"kv_connector": "X", "kv_role": "bogus"})
    with pytest.raises(ValueError, match="kv_role is required"):
        KVTransferConfig(kv_connector="X")
    with pytest.raises(ValueError, match="unknown key"):
        KVTransferConfig.from_cli({"kv_conector": "X"})
    with pytest.raises(ValueError, match="not valid JSON"):
        KVTransferConfig.from_cli("{oops")
    with pytest.raises(ValueError, match="kv_load_failure_policy"):
        KVTransferConfig(kv_connector="X", kv_role="kv_consumer", kv_load_failure_policy="x")


class _Config:
    """The part of an EngineConfig a connector reads (vLLM: VllmConfig)."""

    def __init__(self, kv_transfer_config):
        self.kv_transfer_config = kv_transfer_config


def test_factory_by_module_path_and_registered_name():
    mod = types.ModuleType("kv_plugin_for_test")
    mod.RecordingConnector = _RecordingConnector
    sys.modules["kv_plugin_for_test"] = mod
    cfg = KVTransferConfig(kv_connector="RecordingConnector", kv_role="kv_both",
                           kv_connector_module_path="kv_plugin_for_test")
    worker = KVConnectorFactory.create_connector(_Config(cfg), KVConnectorRole.WORKER)
    assert isinstance(worker, _RecordingConnector) and worker.role is KVConnectorRole.WORKER
    meta = KVConnectorMetadata()
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    assert worker.loaded is meta
    worker.clear_connector_metadata()
    assert worker.get_finished(set()) == (None, None)
    assert worker.request_finished(None, [1]) == (False, None)
    KVConnectorFactory.register_connector("RecordingForTest", "kv_plugin_for_test",
                                          "RecordingConnector")
    sched = KVConnectorFactory.create_connector(
        _Config(KVTransferConfig(kv_connector="RecordingForTest", kv_role="kv_producer")),
        KVConnectorRole.SCHEDULER)
    assert sched.get_num_new_matched_tokens(None, 0) == (16, False)
    with pytest.raises(ValueError, match="unknown KV connector"):
        KVConnectorFactory.create_connector(
            _Config(KVTransferConfig(kv_connector="Nope", kv_role="kv_both")),
            KVConnectorRole.WORKER)


def test_aggregator_reports_only_when_every_worker_finished():
    agg = KVOutputAggregator(expected_finished_count=2)
    first = agg.aggregate([KVConnectorOutput(finished_sending={"a"}, finished_recving={"b"})])
    assert first.finished_sending is None and first.finished_recving is None
    second = agg.aggregate([KVConnectorOutput(finished_sending={"a"}),
                            KVConnectorOutput(finished_recving={"b"})])
    assert second.finished_sending == {"a"} and second.finished_recving == {"b"}


def test_wire_carries_kv_transfer_params_both_ways():
    import msgspec

    from enginecore.protocol import EngineCoreOutput, EngineCoreRequest, decode_request
    from enginecore.sampling_params import SamplingParams

    params = {"do_remote_decode": True, "remote_block_ids": [1, 2], "remote_port": 5}
    req = EngineCoreRequest("r", [1, 2, 3], SamplingParams(), kv_transfer_params=params,
                            abort_immediately=True)
    back = decode_request(msgspec.msgpack.encode(req))
    assert back.kv_transfer_params == params and back.abort_immediately
    # A request from a sender that knows no KV fields still decodes (trailing defaults).
    old = decode_request(msgspec.msgpack.encode(EngineCoreRequest("o", [1])))
    assert old.kv_transfer_params is None and not old.abort_immediately
    out = EngineCoreOutput("r", [4], kv_transfer_params=params)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(out),
                                  type=EngineCoreOutput).kv_transfer_params == params
    with pytest.raises(ValueError, match="kv_transfer_params"):
        decode_request(msgspec.msgpack.encode(
            EngineCoreRequest("b", [1], kv_transfer_params=[1])))  # type: ignore[arg-type]


def test_engine_args_cli_and_llm_spellings(tmp_path):
    import argparse

    from enginecore.config import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    value = json.dumps({"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
                        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}})
    args = parser.parse_args(["--kv-transfer-config", value])
    cfg = EngineArgs.from_cli_args(args).kv_transfer_config
    assert cfg.kv_connector == "SharedStorageConnector" and cfg.is_kv_consumer
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-transfer-config", "{not json"])
    # LLM(...) / EngineArgs(...) take a dict or the object.
    synthetic = EngineArgs(model="synthetic", kv_transfer_config={
        "kv_connector": "X", "kv_role": "kv_producer"}).create_engine_config()
    assert synthetic.kv_transfer_config.is_kv_producer
    assert EngineArgs(model="synthetic").create_engine_config().kv_transfer_config is None
