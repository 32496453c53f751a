package sourcetest_test

import (
	"testing"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/backing/ioengine"
	"github.com/engramfs/engramfs/backing/sourcetest"
)

func TestLocalSource(t *testing.T) {
	sourcetest.Run(t, func(t *testing.T, dir string) backing.Source {
		engine, _, err := ioengine.New("auto", 16)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { engine.Close() })
		return backing.NewLocalSource(dir, backing.IOAuto, engine, nil)
	})
}
