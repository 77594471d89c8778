"""The Triton side of MorphServe: what sits between the engine and a tritonserver.

    params        the config.pbtxt parameter table (parsed at model load, checked by the launcher, docs table)
    metrics       the Prometheus families the model publishes through pb_utils
    config_pbtxt  reading and editing a model's config.pbtxt parameters; the edited repository copy
    discovery     finding tritonserver and its Python backend; the environment the server runs in
    server        launch() and the ServerHandle lifecycle of one running server

Used by the Triton model (model_repository/*/1/model.py) and the launcher CLI (trtllm_backend.serve); the
engine core imports nothing from here. Nothing is imported eagerly: the model loads only what it needs.
"""
