package s3source

import (
	"context"
	"testing"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/backing/s3source/s3test"
	"github.com/engramfs/engramfs/backing/sourcetest"
	"github.com/engramfs/engramfs/internal/stats"
)

// newServerSource uploads dir to a fresh versitygw and opens it as a Source.
func newServerSource(t *testing.T, dir string, cfg Config, st *stats.Counters) (*Source, *s3test.Server, string) {
	srv := s3test.Start(t)
	srv.Env(t)
	srv.Bucket(t, "models")
	url := srv.Upload(t, dir, "models", "dsv41/engram")
	cfg.Client = ClientConfig{Endpoint: srv.Endpoint, PathStyle: true}
	src, err := New(context.Background(), url, cfg, st)
	if err != nil {
		t.Fatal(err)
	}
	return src, srv, url
}

func TestConformanceVersitygw(t *testing.T) {
	sourcetest.Run(t, func(t *testing.T, dir string) backing.Source {
		src, _, _ := newServerSource(t, dir, DefaultConfig(), nil)
		return src
	})
}
