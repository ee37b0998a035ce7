"""Built-in plugins. Each subpackage is registered through the ``zeroplug`` entry-point group."""
