"""Running kvplane's parts on one machine: local engines, in-thread servers."""
