// The client-go peer of `make bench`: how long client-go's leaderelection takes to
// acquire a free Lease (a GET that finds none, then the create), one Lease at a time.
// Usage: acquire KUBECONFIG NAMESPACE COUNT. Prints {"latencies": [seconds, ...]}.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
)

func main() {
	config, err := clientcmd.BuildConfigFromFlags("", os.Args[1])
	if err != nil {
		panic(err)
	}
	// Raised so that client-side rate limiting does not dominate what we measure.
	config.QPS, config.Burst = 10000, 10000
	client := kubernetes.NewForConfigOrDie(config)
	count, _ := strconv.Atoi(os.Args[3])
	latencies := []float64{}
	for i := 0; i < count; i++ {
		lock := &resourcelock.LeaseLock{
			LeaseMeta:  metav1.ObjectMeta{Name: fmt.Sprintf("client-go-%d", i), Namespace: os.Args[2]},
			Client:     client.CoordinationV1(),
			LockConfig: resourcelock.ResourceLockConfig{Identity: "bench"},
		}
		ctx, cancel := context.WithCancel(context.Background())
		acquired := make(chan time.Time, 1)
		elector, err := leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
			Lock: lock, LeaseDuration: 15 * time.Second, RenewDeadline: 10 * time.Second, RetryPeriod: 2 * time.Second,
			Callbacks: leaderelection.LeaderCallbacks{
				OnStartedLeading: func(context.Context) { acquired <- time.Now() },
				OnStoppedLeading: func() {},
			},
		})
		if err != nil {
			panic(err)
		}
		started := time.Now()
		go elector.Run(ctx)
		latencies = append(latencies, (<-acquired).Sub(started).Seconds())
		cancel()
	}
	out, _ := json.Marshal(map[string][]float64{"latencies": latencies})
	fmt.Println(string(out))
}
