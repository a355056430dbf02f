"""Pooling models in the stand-in: sized per model, their `Supported tasks` said, their routes opened and no others."""

from __future__ import annotations

from sim_support import StartSim, http

EMBEDDING_MODEL = "Qwen/Qwen3-Embedding-8B"


def test_embedding_model_says_its_tasks_serves_embeddings_and_refuses_completions_as_vllm_does(sim: StartSim) -> None:
    s = sim(EMBEDDING_MODEL, "--gpu-memory-utilization", "0.2")
    s.wait_ready()
    s.wait_text("Supported tasks: ['embed', 'token_embed']")
    s.wait_text("Route: /v1/embeddings, Methods: POST")
    out = s.stdout.decode()
    assert "Route: /v1/embeddings, Methods: POST" in out and "Route: /v1/completions," not in out
    # Sized as the real checkpoint, not as the default 27B.
    assert "Checkpoint size: 14.10 GiB" in out and "Model loading took 14.1 GiB" in out
    refused = http(s.port, "/v1/completions", {"model": EMBEDDING_MODEL, "prompt": "Hi", "max_tokens": 1})
    assert (refused.status, refused.json()) == (404, {"detail": "Not Found"})
    embedded = http(s.port, "/v1/embeddings", {"model": EMBEDDING_MODEL, "input": "Hi"}).json()
    assert embedded["object"] == "list" and embedded["data"][0]["object"] == "embedding"
    assert len(embedded["data"][0]["embedding"]) == 4096
    assert embedded["usage"]["completion_tokens"] == 0
    assert http(s.port, "/classify", {"input": "Hi"}).status == 404  # an embedding model classifies nothing
    metrics = http(s.port, "/metrics").body.decode()
    assert f'vllm:generation_tokens_total{{engine="0",model_name="{EMBEDDING_MODEL}"}} 0.0' in metrics


def test_embedding_model_at_a_tenth_of_gb10_cannot_hold_its_weights(sim: StartSim) -> None:
    s = sim(EMBEDDING_MODEL, "--gpu-memory-utilization", "0.1")
    assert s.wait_exit() != 0
    s.drain()
    assert "Available KV cache memory: -" in s.stdout.decode()


def test_converted_model_classifies_and_generates_nothing(sim: StartSim) -> None:
    s = sim("m", "--convert", "classify", "--served-model-name", "judge")
    s.wait_ready()
    s.wait_text("Supported tasks: ['classify', 'token_classify']")
    answer = http(s.port, "/classify", {"model": "judge", "input": "Hi"}).json()
    assert answer["data"][0]["label"] == "LABEL_0"
    assert http(s.port, "/pooling", {"model": "judge", "input": "Hi"}).json()["data"][0]["object"] == "pooling"
    assert http(s.port, "/v1/chat/completions", {"model": "judge", "messages": []}).status == 404
