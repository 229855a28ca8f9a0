"""Old home of the example models, now `dcp_pass.models`; its modules alias the new ones."""
