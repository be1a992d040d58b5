"""What tests in every folder share: paths, launchers, the diffusers reference, trained runs."""
