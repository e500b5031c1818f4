"""Built-in storage plugins, registered in the ``dcp.storage_plugins`` entry-point group."""
