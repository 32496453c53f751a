package s3source

import (
	"context"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	v4 "github.com/aws/aws-sdk-go-v2/aws/signer/v4"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/aws/smithy-go/encoding/httpbinding"
)

// signedGetter is the data path: ranged GETs as plain net/http requests
// signed with SigV4 (the SDK's signer, the SDK's credentials). The SDK's
// GetObject builds a middleware stack and decodes every response header on
// each call, which cost more client CPU than the HTTP exchange itself
// (BenchmarkGetRange*); HEAD, LIST and the index stay on the SDK client.
type signedGetter struct {
	hc     aws.HTTPClient // the SDK's client: one connection pool
	creds  aws.CredentialsProvider
	signer *v4.Signer
	region string
	// base is the bucket's URL (path style: ENDPOINT/bucket; virtual
	// hosted: bucket.ENDPOINT), as the SDK's endpoint resolver gives it.
	base url.URL
}

// emptySHA256 is the payload hash of a GET: its body is empty.
const emptySHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"

func newSignedGetter(ctx context.Context, api *s3.Client, bucket string) (*signedGetter, error) {
	o := api.Options()
	p := s3.EndpointParameters{
		Bucket:         aws.String(bucket),
		Region:         aws.String(o.Region),
		Endpoint:       o.BaseEndpoint,
		ForcePathStyle: aws.Bool(o.UsePathStyle),
		UseFIPS:        aws.Bool(o.EndpointOptions.UseFIPSEndpoint == aws.FIPSEndpointStateEnabled),
		UseDualStack:   aws.Bool(o.EndpointOptions.UseDualStackEndpoint == aws.DualStackEndpointStateEnabled),
	}
	ep, err := o.EndpointResolverV2.ResolveEndpoint(ctx, p)
	if err != nil {
		return nil, fmt.Errorf("object store endpoint for bucket %s: %w", bucket, err)
	}
	g := &signedGetter{
		hc: o.HTTPClient, creds: o.Credentials, region: o.Region, base: ep.URI,
		signer: v4.NewSigner(func(so *v4.SignerOptions) {
			so.DisableURIPathEscaping = true // S3 paths are escaped once, by us
		}),
	}
	if _, anon := g.creds.(aws.AnonymousCredentials); anon {
		g.creds = nil
	}
	g.base.Path = strings.TrimSuffix(g.base.Path, "/")
	g.base.RawPath = ""
	return g, nil
}

// objectURL is the URL of key.
func (g *signedGetter) objectURL(key string) *url.URL {
	u := g.base
	u.RawPath = httpbinding.EscapePath(u.Path, false) + "/" + httpbinding.EscapePath(key, false)
	u.Path += "/" + key
	return &u
}

// GetRange is objectClient.GetRange over signed net/http: If-Match the
// ETag; only a 206 with exactly the asked Content-Range is data.
func (g *signedGetter) GetRange(ctx context.Context, key string, off, n int64, etag string) (io.ReadCloser, error) {
	u := g.objectURL(key)
	req := (&http.Request{
		Method: http.MethodGet, URL: u, Host: u.Host,
		Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
		Header: http.Header{
			"Range":                {rangeHeader(off, n)},
			"If-Match":             {etag},
			"X-Amz-Content-Sha256": {emptySHA256},
		},
	}).WithContext(ctx)
	if err := g.sign(ctx, req); err != nil {
		return nil, fmt.Errorf("GET %s: %w", key, err)
	}
	resp, err := g.hc.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return nil, fmt.Errorf("GET %s: %w", key, ctx.Err())
		}
		return nil, retryablef("GET %s: %w", key, err) // reset, refused, EOF, timeout
	}
	if resp.StatusCode != http.StatusPartialContent {
		err := statusError(resp, "GET "+key)
		discard(resp.Body)
		return nil, err
	}
	if err := checkRange(resp.StatusCode, resp.Header.Get("Content-Range"), resp.ContentLength, off, n); err != nil {
		discard(resp.Body)
		return nil, fmt.Errorf("GET %s: %w", key, err)
	}
	return resp.Body, nil
}

// sign signs req with the current credentials (the provider chain's cache
// refreshes them before they expire); anonymous access sends it unsigned.
func (g *signedGetter) sign(ctx context.Context, req *http.Request) error {
	if g.creds == nil {
		return nil
	}
	c, err := g.creds.Retrieve(ctx)
	if err != nil {
		return fmt.Errorf("credentials: %w", err)
	}
	return g.signer.SignHTTP(ctx, c, req, emptySHA256, "s3", g.region, time.Now())
}

// statusError classifies an answer other than 206, as classify does the
// SDK's errors.
func statusError(resp *http.Response, op string) error {
	code := resp.StatusCode
	switch {
	case code == http.StatusPreconditionFailed:
		return fmt.Errorf("%s: %w", op, errPrecondition)
	case code == http.StatusNotFound:
		return fmt.Errorf("%s: %w (HTTP 404)", op, fs.ErrNotExist)
	case code >= 500 || code == http.StatusTooManyRequests || code == http.StatusRequestTimeout:
		return retryablef("%s: HTTP %d", op, code)
	case code == http.StatusOK:
		// The whole object, from a store or proxy that ignores Range:
		// never data.
		return retryablef("%s: HTTP 200 instead of 206 Partial Content (%s bytes)", op, strconv.FormatInt(resp.ContentLength, 10))
	default:
		return fmt.Errorf("%s: HTTP %d", op, code)
	}
}

// discard reads a little of an unwanted body, so that the connection can
// be reused, and closes it.
func discard(body io.ReadCloser) {
	_, _ = io.Copy(io.Discard, io.LimitReader(body, 64<<10))
	body.Close()
}
