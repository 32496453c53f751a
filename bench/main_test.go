package bench

import (
	"os"
	"testing"

	"github.com/engramfs/engramfs/internal/testenv"
)

// TestMain removes the binaries the tests built once they are done.
func TestMain(m *testing.M) { os.Exit(testenv.Run(m)) }
