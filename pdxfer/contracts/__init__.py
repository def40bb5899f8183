"""What the serving layer (pdxfer.serve), the connector (pdxfer.vllm) and the master agree on, in
modules that import none of them: the connector's configuration and its parser, the publish hint
carried in kv_transfer_params, the connector's metric definitions and load phases, the
block-id convention of holder tiers, and the spin setting for instances sharing cores."""
