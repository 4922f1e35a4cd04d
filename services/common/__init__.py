"""What every service shares: flags/env config, logging, gRPC server setup, errors."""
