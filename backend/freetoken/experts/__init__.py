"""Where the routed experts' weights live: resident on the device, or offloaded to host memory
behind a device cache of expert slots (issue 11)."""
