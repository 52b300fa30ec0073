"""Scripts that run inside the emulated hosts' network namespaces (`ip netns exec`)."""
