"""A worker's ps-lite environment, for tests that build a ``ClusterEnv`` by hand."""

BASE = {"DMLC_ROLE": "worker", "DMLC_NUM_WORKER": "4", "DMLC_NUM_SERVER": "2",
        "DMLC_PS_ROOT_URI": "10.0.0.1", "DMLC_PS_ROOT_PORT": "9000", "DMLC_WORKER_ID": "3"}
